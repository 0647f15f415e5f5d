"""The service's routes, one module per family, each registering its routes on the app from the
shared `ServiceContext` (`context.py`): `tgi.py` (TGI's generation routes), `openai.py` (OpenAI's
completions, chat and models), `tokenize.py` (vLLM's and TGI's tokenizer routes), `admin.py` (health,
info, metrics, version, SageMaker's ping and invocations); `errors.py` answers errors in each route
family's schema. `wafer_gpt2.service.api.create_app` composes them."""
