"""What a run records about itself: metrics.csv, TensorBoard, MLflow, W&B and loss.png.

Rank 0 of the workers writes the metrics and trackers; the driver draws the loss plot.
"""
