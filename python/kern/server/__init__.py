"""The HTTP server's parts under the ASGI entry ``kern.app``: the wire types, the reasoning and
tool-call splitter, and the request logs.

Nothing is imported here on purpose: each module is imported by name.
"""
