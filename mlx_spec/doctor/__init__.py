"""``mlx_spec doctor``: checks and measures this machine with a model.

Six parts, each with a pass / fail / skip and a reason, each run whatever
the others gave: ``platform.py`` (machine, versions, BLAS), ``model.py``
(what was loaded, where its MTP head came from, whether it is this model's
and works), ``kernels.py`` (the Metal kernels and their MLX references on the
model's shapes), ``lossless.py`` (greedy speculative output against plain
decoding), ``speed.py`` (verify costs, tokens/s, acceptance, the recommended
settings) and the report (``report.py``: terminal, Markdown, versioned JSON).
``runner.py`` runs them in order. See docs/doctor.md.
"""

from .report import SCHEMA, SCHEMA_VERSION
from .runner import PARTS, run_doctor

__all__ = ["PARTS", "SCHEMA", "SCHEMA_VERSION", "run_doctor"]
