"""edgepack: pack a trained model into one bundle per edge device and run it there."""

__version__ = "0.1.0"
