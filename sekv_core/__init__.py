"""sekv engine: documents, models, SeKV memory and answering."""
