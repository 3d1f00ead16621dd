// Greedy generation from token ids with llama.cpp's C API, printing every step's top-2 logits,
// and (optionally) the logits of every position as a float32 .npy of shape [ids + gen, vocab]:
// the prompt's positions from one batched forward pass, then one row per generated token
// (each from a single-token decode step). kimi_gguf.sh builds it against the static libraries
// of bench/llamacpp/build.sh and compares it with `kimi-infer run --logprobs` and `kimi-infer logits`.
//
// Usage: llama-greedy-logits MODEL.gguf THREADS N_GEN ID,ID,... [OUT.npy]
// Prints "prompt: ids", then per step "step i: id=I top1=L1 top2=ID2:L2 margin=M", then
// "greedy: ids".
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS N_GEN ID,ID,... [OUT.npy]\n", argv[0]);
        return 2;
    }
    const int n_threads = atoi(argv[2]);
    const int n_gen     = atoi(argv[3]);
    std::vector<llama_token> ids;
    for (char * p = strtok(argv[4], ","); p; p = strtok(nullptr, ",")) {
        ids.push_back((llama_token) atoi(p));
    }
    if (ids.empty() || n_threads < 1 || n_gen < 0) {
        fprintf(stderr, "need ids, THREADS >= 1, N_GEN >= 0\n");
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = (uint32_t) (ids.size() + n_gen + 16);
    cp.n_batch         = (uint32_t) ids.size();
    cp.n_ubatch        = (uint32_t) ids.size();
    cp.n_threads       = n_threads;
    cp.n_threads_batch = n_threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<float> rows;

    llama_batch batch = llama_batch_init((int32_t) ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); i++) {
        batch.token[i]     = ids[i];
        batch.pos[i]       = (llama_pos) i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i]    = 1;
    }
    batch.n_tokens = (int32_t) ids.size();
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "prompt decode failed\n");
        return 1;
    }
    for (size_t i = 0; i < ids.size(); i++) {
        const float * l = llama_get_logits_ith(ctx, (int32_t) i);
        rows.insert(rows.end(), l, l + n_vocab);
    }
    printf("prompt:");
    for (size_t i = 0; i < ids.size(); i++) {
        printf("%s%d", i ? "," : " ", ids[i]);
    }
    printf("\n");

    std::vector<llama_token> out;
    const float * logits = llama_get_logits_ith(ctx, (int32_t) ids.size() - 1);
    for (int step = 0; step < n_gen; step++) {
        int best = 0, second = -1;
        for (int v = 1; v < n_vocab; v++) {
            if (logits[v] > logits[best]) {
                second = best;
                best   = v;
            } else if (second < 0 || logits[v] > logits[second]) {
                second = v;
            }
        }
        printf("step %d: id=%d top1=%.4f top2=%d:%.4f margin=%.4f\n", step, best, logits[best], second,
               logits[second], logits[best] - logits[second]);
        out.push_back(best);
        if (step + 1 == n_gen) {
            break;
        }
        llama_batch one = llama_batch_get_one(&out.back(), 1);
        if (llama_decode(ctx, one) != 0) {
            fprintf(stderr, "decode failed at step %d\n", step);
            return 1;
        }
        logits = llama_get_logits_ith(ctx, -1);
        rows.insert(rows.end(), logits, logits + n_vocab);
    }
    printf("greedy:");
    for (size_t i = 0; i < out.size(); i++) {
        printf("%s%d", i ? "," : " ", out[i]);
    }
    printf("\n");

    if (argc > 5) {
        FILE * f = fopen(argv[5], "wb");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", argv[5]);
            return 1;
        }
        const size_t n_rows = rows.size() / n_vocab;
        std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(n_rows) +
                             ", " + std::to_string(n_vocab) + "), }";
        while ((10 + header.size() + 1) % 64 != 0) {
            header += ' ';
        }
        header += '\n';
        const unsigned short hlen = (unsigned short) header.size();
        fwrite("\x93NUMPY\x01\x00", 1, 8, f);
        fwrite(&hlen, 2, 1, f);
        fwrite(header.data(), 1, header.size(), f);
        fwrite(rows.data(), sizeof(float), rows.size(), f);
        fclose(f);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
