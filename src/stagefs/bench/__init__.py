"""Generated datasets, the demo, and the benchmark behind ``stagefs bench``."""
