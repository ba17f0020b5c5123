"""N-gram speculators (llama.cpp's ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod)."""
