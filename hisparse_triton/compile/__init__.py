"""The compile report: what every kernel launch the runtime can make costs on a GPU you may
not have (registers, spills, shared memory / LDS, occupancy, and a static cost model).

``report`` (``hisparse-triton compile-report``, ``python -m hisparse_triton.compile.report``)
asks the launchers in ``hisparse_triton.kernels`` what they would launch and compiles each
launch for an NVIDIA (``target_compiler`` + ``report``) or AMD (``amd_report``) target with
Triton's own compiler, on any machine; ``sass_model`` is the issue-cycle model of the NVIDIA
SASS and ``loop_trips`` its per-kernel inputs. A tuning tool: nothing on the decode path
imports this package.
"""
