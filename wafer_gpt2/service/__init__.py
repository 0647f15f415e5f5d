"""The HTTP service: the FastAPI app (`api.py`), the TGI and OpenAI routes, validation, the lean hot
routes, the server and its connections."""
