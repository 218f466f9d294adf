"""Ports: one typing.Protocol per file. Imports the domain only."""
