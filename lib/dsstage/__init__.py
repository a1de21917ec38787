"""dsstage: stage training datasets onto compute nodes' local storage before jobs need them."""

__version__ = "0.3.0.dev0"
