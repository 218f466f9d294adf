"""The pure model of rl-refit: formats, codecs, plans, dispatch, buckets, refit state, math.

Imports only the standard library, attrs and torch (as a numeric library).
"""
