"""Engine adapters: the Engine protocol (``base``), a real-time fake engine with fault injection
(``fake``), vLLM (``vllm``) and the tiny test model (``tiny_model``)."""
