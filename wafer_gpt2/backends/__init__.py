"""What runs the model behind the engine's `Backend` contract (`wafer_gpt2.core.steps`): `registry.py`
chooses one by name (`build_backend`)."""
