"""Tracing for every process of the cluster behind one module with a no-op fallback
(`telemetry`), the spans of one request on a worker (`request_trace`) and the trace file
exporter (`trace_file`).
"""
