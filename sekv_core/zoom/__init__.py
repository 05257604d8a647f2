"""The zoom memory: a store's resident tier, the pool of zoomed rows, reconstruction, routing,
the mixed attention and the zoom trace."""
