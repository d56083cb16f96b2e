"""Triton kernels and their thin typed launchers, installed as ``hisparse_triton.kernels``.

Import as ``hisparse_triton.kernels.<module>`` only. Set ``TRITON_INTERPRET=1`` before the first
import to run them on CPU tensors.
"""
