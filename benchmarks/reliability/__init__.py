"""Long and hostile runs against a server: `batchwire bench soak` and `chaos`."""
