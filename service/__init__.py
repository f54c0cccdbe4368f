"""ringlab's service: database layer, REST API, scheduler loop, dashboard and CLI.

Sits on top of `workers` (what runs on Ray) and `attention` (the kernels); nothing below imports it.
"""
