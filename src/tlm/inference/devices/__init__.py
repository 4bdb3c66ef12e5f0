"""What a decode asks of the machine: the thread count each step runs on (`threads.py`),
CUDA graphs on a GPU (`cuda_graph.py`) and glibc's heap given back to the system
(`heap.py`)."""
