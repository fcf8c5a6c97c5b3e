"""lintrans: linear transformers and efficient attention, every form, verified and measured."""
__version__ = "0.1.0"
