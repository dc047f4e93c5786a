"""Cells and pools on Dask: resources, the embedded cluster, routing and the scheduler plugin."""
