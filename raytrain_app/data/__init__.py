"""Built-in data: the synthetic wind generator and Parquet (context, horizon) windows."""
