"""Integrations with serving stacks that call HiSparse through their own op names.

``hisparse_triton.integrations.vllm``: vLLM 0.33's HiSparse custom ops (``register()``).
Importing this package imports no serving stack.
"""
