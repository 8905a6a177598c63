"""Watching and explaining: the Prometheus exporter and the doctor for failed starts.
"""
