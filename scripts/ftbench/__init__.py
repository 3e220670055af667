"""ftbench: measure what fine-tuning costs (memory, accuracy, throughput, dollars).

The Snakemake rules call thin entry points in ``scripts/``; the work lives in this package so that
pytest can import and test every piece directly.
"""

__version__ = "0.1.0"
