"""Package data: the embedded training corpus (``shakespeare.txt.gz``), read by ``ddiloco.data``."""
