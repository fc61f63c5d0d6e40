"""The gateway's OpenAI-compatible HTTP front door (FastAPI on uvicorn, on the gateway's event
loop): /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize, /detokenize. A second
door onto the same Frontend as gRPC: it converts, it does not generate."""
