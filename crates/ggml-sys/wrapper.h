/* The public ggml headers whose functions live in libggml-base. */
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "gguf.h"
