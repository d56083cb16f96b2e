"""Triton kernels and their thin typed launchers, installed as ``hisparse_triton.kernels``.

Import as ``hisparse_triton.kernels.<module>`` only. Set ``TRITON_INTERPRET=1`` before the first
import to run them on CPU tensors; the import then checks that the interpreter of the installed
Triton works with the installed NumPy (``hisparse_triton.compat.check_interpreter``).
"""

from hisparse_triton.compat import check_interpreter

check_interpreter()
