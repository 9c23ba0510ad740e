"""The loops over a built engine: the single-stream DFlash runtime (`single`), continuous batching (`batching`), the
costs both steer by (`costs`: recorded, or fitted on the machine that runs them), the PyTorch reference loop
(`reference`) and the commands that drive them (`run`, `demo`, `reference`)."""
