"""``mlx_spec server``'s parts: the HTTP front (``http.py``, Starlette on
uvicorn, with ``wire.py``: bodies, JSON, events and errors; ``guard.py``: the
Host, Origin and API key checks; ``bridge.py``: the engine's events to the
async handlers), request checking (``requests.py``; the prompt:
``prompts.py``), OpenAI's and Anthropic's requests and response shapes
(``openai.py``, ``anthropic.py``), the batching generation worker
(``engine.py``, with the jobs and events of ``events.py``) and the joining
prompts' prefill (``prefill.py``). The states it keeps are
:mod:`mlx_spec.states`. See docs/serving.md."""
