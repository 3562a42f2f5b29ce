"""``logra-pl serve``: a vLLM engine behind an HTTP API that receives LoGRA factor payloads and full weights."""
