"""The engine: what turns submitted requests into tokens.

Nothing is imported here on purpose: importing one module of the package (the request, the
scheduler) must not pull in torch through the others.
"""
