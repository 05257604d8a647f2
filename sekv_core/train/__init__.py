"""Training the zoom-in router with the base model frozen (`sekv train`)."""
