"""The service's routes, one module per family, each registering its routes on the app from the
shared `ServiceContext` (`context.py`): `tgi_routes.py` (TGI's generation routes), `openai_routes.py` (OpenAI's
completions, chat and models), `tokenize_routes.py` (vLLM's and TGI's tokenizer routes), `admin_routes.py` (health,
info, metrics, version, SageMaker's ping and invocations); `error_handlers.py` answers errors in each route
family's schema. `wafer_gpt2.service.api.create_app` composes them."""
