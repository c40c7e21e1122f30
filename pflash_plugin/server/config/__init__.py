"""What the server is told: its settings, the command line, llama.cpp's parameters from them."""
