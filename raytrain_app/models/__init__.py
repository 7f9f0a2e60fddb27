"""Built-in models: pure nn.Modules with no device, rank or DDP logic."""
