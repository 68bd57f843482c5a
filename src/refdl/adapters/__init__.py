"""Adapters to external frameworks: the same model, weights, data order and optimizer
built in another framework, so its results can be checked against refdl's."""
