"""The iop node agent: dials edges, runs requests against a model server."""
