// The log filter: drops llama.cpp's, ggml's and libmtmd's lines below a level before they reach
// Python (see pflash_ext.h).
#include "pflash_ext.h"

#include <atomic>

namespace {

constexpr int32_t LEVEL_NONE = 0, LEVEL_INFO = 2, LEVEL_CONT = 5;

std::atomic<pfx_log_callback> g_forward{nullptr};
std::atomic<int32_t> g_min_level{LEVEL_INFO};
thread_local bool t_forwarding = false;  // whether this thread's last line went on (its CONT parts follow it)

}  // namespace

extern "C" void pfx_log_forward(pfx_log_callback forward, int32_t min_level) {
    g_min_level.store(min_level);
    g_forward.store(forward);
}

extern "C" void pfx_log_filter(int32_t level, const char * text, void * user_data) {
    if (level != LEVEL_CONT) {
        t_forwarding = (level == LEVEL_NONE ? LEVEL_INFO : level) >= g_min_level.load(std::memory_order_relaxed);
    }
    pfx_log_callback forward = g_forward.load(std::memory_order_relaxed);
    if (t_forwarding && forward != nullptr) {
        forward(level, text, user_data);
    }
}
