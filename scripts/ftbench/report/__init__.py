"""From finished runs to answers: collect (every metrics.json into ``metrics.parquet`` with costs, MFU and
projections, its columns defined once in ``columns.py``), the run table's analysis (configurations,
intervals, recommendation, Pareto front), figures, the HTML pages (report and compare) and the end-of-run
summary. Runs in the analysis environment, without torch; may import measure, data and the ground modules.
"""
