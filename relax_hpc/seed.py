"""The default seed, said once.

``run.seed`` (data order, sampling, the engines), ``train.seed`` (the actor's init and RNGs) and a data source
built without a run seed (:func:`relax_hpc.rollout.data.data_source_from_config`) all default to it. Two keys,
not one: a recipe may set them apart. A leaf (it imports nothing), so the recipe, ``train`` and ``rollout`` can
all use it.
"""

DEFAULT_SEED = 1234
