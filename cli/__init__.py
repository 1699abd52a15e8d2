"""``tandem``, the one command: the top of the import graph (cli → services, loadtest →
common → kernels). No module under services, loadtest or common imports it; ``python -m cli`` is ``tandem``."""
