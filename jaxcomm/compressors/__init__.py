"""Compressors: one module per family, each a small :class:`jaxcomm.core.Compressor`."""
