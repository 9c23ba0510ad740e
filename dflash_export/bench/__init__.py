"""`dflash-export bench`: DFlash against plain decoding, transformers and the PyTorch reference, one stream
(`suite`) or under continuous batching (`concurrency`). Peers (llama.cpp, ONNX Runtime GenAI) live in benchmarks/."""
