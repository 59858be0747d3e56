"""Engine side: Llama-family model, paged KV pool, store connector, chat sessions."""
