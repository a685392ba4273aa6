// Writes reference.txt: numbers produced by the reference implementation's own sampling code.
//
// This program contains no copy of stable-diffusion.cpp: it #includes the reference's headers
// (rng_philox.hpp, rng_mt19937.hpp, denoiser.hpp, tensor.hpp) and its guidance.cpp from the
// pinned source that the `diffusion-rs-sys = "=0.1.20"` crate ships (sd.cpp of 2026-06-14), in the
// same include order as the reference's stable-diffusion.cpp, so that every unqualified math call
// resolves to the same overload as in the reference build. It then prints
//   - Philox (`--rng cuda`) and torch-CPU mt19937 (`--rng cpu`) noise,
//   - the CompVis sigma table, sigma<->timestep conversions and the eps / v scalings,
//   - the sigmas of every scheduler for several step counts,
//   - the output of every sampler on an analytic denoiser (and the sigmas and step
//     numbers it was called with),
//   - one classifier-free-guided denoiser evaluation built from the reference's own pieces,
//   - then the same for the flow-matching denoisers of FLUX.1 (shift 1 and 1.15) and SD3 (shift 3):
//     sigma ranges, t <-> sigma, scalings, the schedulers, the samplers with is_flow_denoiser.
// The denoiser and the fake model below are ours; the arithmetic they use is plain float that
// Rust reproduces operation by operation.
//
// Regenerate (from this directory; REF is the stable-diffusion.cpp folder inside diffusion-rs-sys):
//   REF=~/.cargo/registry/src/*/diffusion-rs-sys-0.1.20/stable-diffusion.cpp
//   g++ -std=c++17 -O2 -ffp-contract=off -DGGML_MAX_NAME=128 -I$REF/src -I$REF/include \
//       -I$REF/ggml/include -I$REF/thirdparty gen_reference.cpp $REF/src/runtime/guidance.cpp \
//       -o /tmp/gen_reference && /tmp/gen_reference > reference.txt
// (x86-64 without -march: like the reference build, no FMA contraction.)
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
#include <unordered_set>
#include <vector>

#include "core/ggml_extend.hpp"

#include "core/rng.hpp"
#include "core/rng_mt19937.hpp"
#include "core/rng_philox.hpp"
#include "core/util.h"
#include "runtime/denoiser.hpp"
#include "runtime/guidance.h"

// The few util.cpp functions the included headers reference; the sampling paths exercised here
// never log or receive extra arguments.
KeyValueArgs parse_key_value_args(const char*, const char*) { return {}; }
KeyValueArgs parse_key_value_args(const std::string&, const char*) { return {}; }
bool parse_strict_float(const std::string&, float&) { return false; }
bool parse_strict_int(const std::string&, int&) { return false; }
bool parse_strict_bool(const std::string&, bool&) { return false; }
void log_printf(sd_log_level_t, const char*, int, const char*, ...) {}
// GGML_ASSERT's failure path (never reached here).
extern "C" void ggml_abort(const char* file, int line, const char* fmt, ...) {
    std::fprintf(stderr, "assertion failed at %s:%d (%s)\n", file, line, fmt);
    std::abort();
}

static void print_values(const char* head, const std::vector<float>& v) {
    std::printf("%s:", head);
    for (float x : v) {
        std::printf(" %.9g", x);
    }
    std::printf("\n");
}

static std::shared_ptr<CompVisDenoiser> make_compvis() {
    // As StableDiffusionGGML::init does when the checkpoint carries no alphas_cumprod.
    auto d = std::make_shared<CompVisDenoiser>();
    float alphas_cumprod[TIMESTEPS];
    float ls_sqrt = sqrtf(0.00085f);
    float le_sqrt = sqrtf(0.0120f);
    float amount  = le_sqrt - ls_sqrt;
    float product = 1.0f;
    for (int i = 0; i < TIMESTEPS; i++) {
        float beta = ls_sqrt + amount * ((float)i / (TIMESTEPS - 1));
        product *= 1.0f - powf(beta, 2.0f);
        alphas_cumprod[i] = product;
    }
    for (int i = 0; i < TIMESTEPS; i++) {
        d->sigmas[i]     = std::sqrt((1 - alphas_cumprod[i]) / alphas_cumprod[i]);
        d->log_sigmas[i] = std::log(d->sigmas[i]);
    }
    return d;
}

// Analytic denoiser: pulls x towards a fixed target, more strongly at low sigma.
static std::vector<float> target_of(size_t n) {
    std::vector<float> t(n);
    for (size_t i = 0; i < n; i++) {
        t[i] = 0.25f * (float)(i % 5) - 0.5f;
    }
    return t;
}

static sd::Tensor<float> analytic_denoise(const sd::Tensor<float>& x, float sigma) {
    std::vector<float> tgt = target_of((size_t)x.numel());
    float a                = 0.5f * sigma / (sigma + 1.0f);
    float b                = 1.0f - a;
    sd::Tensor<float> out  = x;
    for (int64_t i = 0; i < x.numel(); i++) {
        out[i] = x[i] * a + tgt[(size_t)i] * b;
    }
    return out;
}

// The CFG++ samplers' unconditional estimate: a weaker pull towards a shifted target.
static sd::Tensor<float> analytic_denoise_uncond(const sd::Tensor<float>& x, float sigma) {
    std::vector<float> tgt = target_of((size_t)x.numel());
    float a                = 0.7f * sigma / (sigma + 1.0f);
    float b                = 1.0f - a;
    sd::Tensor<float> out  = x;
    for (int64_t i = 0; i < x.numel(); i++) {
        out[i] = x[i] * a + (tgt[(size_t)i] + 0.125f) * b;
    }
    return out;
}

int main() {
    std::printf("# generated by gen_reference.cpp from the reference's own headers\n");

    // ---- Philox (`--rng cuda`): successive requests on one generator.
    for (uint64_t seed : {0ull, 42ull, 1234567890123ull}) {
        PhiloxRNG rng(seed);
        uint32_t sizes[] = {8, 5, 16};
        for (int r = 0; r < 3; r++) {
            char head[128];
            std::snprintf(head, sizeof(head), "philox %llu %d %u", (unsigned long long)seed, r, sizes[r]);
            print_values(head, rng.randn(sizes[r]));
        }
    }

    // ---- torch CPU mt19937 (`--rng cpu`): small (< 16) and large (>= 16, not a multiple) requests.
    for (uint64_t seed : {0ull, 42ull}) {
        MT19937RNG rng(seed);
        uint32_t sizes[] = {5, 3, 16, 37, 1};
        for (int r = 0; r < 5; r++) {
            char head[128];
            std::snprintf(head, sizeof(head), "cpu %llu %d %u", (unsigned long long)seed, r, sizes[r]);
            print_values(head, rng.randn(sizes[r]));
        }
    }

    // ---- CompVis schedule.
    auto den = make_compvis();
    print_values("sigma_table", std::vector<float>(den->sigmas, den->sigmas + TIMESTEPS));
    std::vector<float> probe_sigmas = {0.0291675f, 0.03f, 0.1f, 0.5f, 1.0f, 2.5f, 7.0f, 14.0f, 14.6146f, 20.0f, 0.01f};
    print_values("sigma_to_t_in", probe_sigmas);
    std::vector<float> ts;
    for (float s : probe_sigmas) {
        ts.push_back(den->sigma_to_t(s));
    }
    print_values("sigma_to_t_out", ts);
    std::vector<float> probe_ts = {0.f, 0.5f, 1.f, 10.25f, 499.5f, 998.75f, 999.f};
    print_values("t_to_sigma_in", probe_ts);
    std::vector<float> sig;
    for (float t : probe_ts) {
        sig.push_back(den->t_to_sigma(t));
    }
    print_values("t_to_sigma_out", sig);

    CompVisVDenoiser vden;
    for (float s : probe_sigmas) {
        auto e = den->get_scalings(s);
        auto v = vden.get_scalings(s);
        char head[128];
        std::snprintf(head, sizeof(head), "scalings %.9g", s);
        print_values(head, {e[0], e[1], e[2], v[0], v[1], v[2]});
    }

    // ---- Schedulers.
    struct NamedScheduler {
        const char* name;
        scheduler_t type;
    };
    NamedScheduler schedulers[] = {
        {"discrete", DISCRETE_SCHEDULER},
        {"karras", KARRAS_SCHEDULER},
        {"exponential", EXPONENTIAL_SCHEDULER},
        {"sgm_uniform", SGM_UNIFORM_SCHEDULER},
        {"simple", SIMPLE_SCHEDULER},
        {"lcm", LCM_SCHEDULER},
        {"smoothstep", SMOOTHSTEP_SCHEDULER},
        {"kl_optimal", KL_OPTIMAL_SCHEDULER},
        {"ays", AYS_SCHEDULER},
        {"gits", GITS_SCHEDULER},
        {"bong_tangent", BONG_TANGENT_SCHEDULER},
        {"ltx2", LTX2_SCHEDULER},
    };
    for (const auto& s : schedulers) {
        // 22 and 43 steps: the discrete schedule's last timestep comes out as -6.1e-5 in float.
        // Karras and exponential divide by n - 1, so one step gives NaN there: not printed.
        // GITS reads row n - 2 of its table: undefined for one step.
        bool one_step_defined = s.type != KARRAS_SCHEDULER && s.type != EXPONENTIAL_SCHEDULER && s.type != GITS_SCHEDULER;
        for (uint32_t n : {1u, 2u, 3u, 4u, 7u, 10u, 20u, 22u, 25u, 43u, 50u, 1000u}) {
            if ((n == 1 && !one_step_defined) || (n == 1000 && s.type != DISCRETE_SCHEDULER)) {
                continue;
            }
            char head[128];
            std::snprintf(head, sizeof(head), "schedule %s %u", s.name, n);
            print_values(head, den->get_sigmas(n, 0, s.type, VERSION_SD1));
        }
    }

    // ---- LTX-2 for a given number of latent positions (64: a 64x64 image; 4096 is the fallback above).
    for (int seq : {64, 256, 1024}) {
        for (uint32_t n : {1u, 2u, 3u, 4u, 10u}) {
            char head[128];
            std::snprintf(head, sizeof(head), "schedule ltx2@%d %u", seq, n);
            print_values(head, den->get_sigmas(n, seq, LTX2_SCHEDULER, VERSION_SD1));
        }
    }

    // ---- Samplers on the analytic denoiser, Philox noise shared with the sampler (as in the
    // reference when --sampler-rng is not given).
    struct NamedMethod {
        const char* name;
        sample_method_t method;
        float eta;
    };
    NamedMethod methods[] = {
        {"euler", EULER_SAMPLE_METHOD, 0.f},
        {"euler_a", EULER_A_SAMPLE_METHOD, 1.f},
        {"euler_a_eta0", EULER_A_SAMPLE_METHOD, 0.f},
        {"euler_a_eta05", EULER_A_SAMPLE_METHOD, 0.5f},
        {"heun", HEUN_SAMPLE_METHOD, 0.f},
        {"dpm2", DPM2_SAMPLE_METHOD, 0.f},
        {"dpm++2s_a", DPMPP2S_A_SAMPLE_METHOD, 1.f},
        {"dpm++2s_a_eta0", DPMPP2S_A_SAMPLE_METHOD, 0.f},
        {"dpm++2m", DPMPP2M_SAMPLE_METHOD, 0.f},
        {"lcm", LCM_SAMPLE_METHOD, 0.f},
        {"dpm++2mv2", DPMPP2Mv2_SAMPLE_METHOD, 0.f},
        {"ipndm", IPNDM_SAMPLE_METHOD, 0.f},
        {"ipndm_v", IPNDM_V_SAMPLE_METHOD, 0.f},
        {"ddim_trailing", DDIM_TRAILING_SAMPLE_METHOD, 0.f},
        {"tcd", TCD_SAMPLE_METHOD, 0.f},
        {"tcd_eta03", TCD_SAMPLE_METHOD, 0.3f},
        {"res_multistep", RES_MULTISTEP_SAMPLE_METHOD, 0.f},
        {"res_multistep_eta1", RES_MULTISTEP_SAMPLE_METHOD, 1.f},
        {"res_2s", RES_2S_SAMPLE_METHOD, 0.f},
        {"res_2s_eta1", RES_2S_SAMPLE_METHOD, 1.f},
        {"er_sde", ER_SDE_SAMPLE_METHOD, 1.f},
        {"er_sde_eta0", ER_SDE_SAMPLE_METHOD, 0.f},
        {"euler_cfg_pp", EULER_CFG_PP_SAMPLE_METHOD, 0.f},
        {"euler_a_cfg_pp", EULER_A_CFG_PP_SAMPLE_METHOD, 1.f},
        {"euler_ge", EULER_GE_SAMPLE_METHOD, 0.f},
        {"euler_ge_eta1", EULER_GE_SAMPLE_METHOD, 1.f},
    };
    struct Run {
        scheduler_t scheduler;
        const char* scheduler_name;
        uint32_t steps;
        uint64_t seed;
        uint32_t numel;
    };
    Run runs[] = {
        {DISCRETE_SCHEDULER, "discrete", 4, 42, 16},
        {KARRAS_SCHEDULER, "karras", 6, 7, 13},
        {LCM_SCHEDULER, "lcm", 3, 1, 16},
    };
    for (const auto& m : methods) {
        for (const auto& run : runs) {
            std::vector<float> sigmas = den->get_sigmas(run.steps, 0, run.scheduler, VERSION_SD1);
            std::shared_ptr<RNG> rng  = std::make_shared<PhiloxRNG>(run.seed);
            sd::Tensor<float> init    = sd::zeros<float>({(int64_t)run.numel});
            sd::Tensor<float> noise   = sd::Tensor<float>::randn_like(init, rng);
            sd::Tensor<float> x       = den->noise_scaling(sigmas[0], noise, init);
            std::vector<float> call_sigmas;
            std::vector<float> call_steps;
            denoise_cb_t cb = [&](const sd::Tensor<float>& xin, float sigma, int step) {
                call_sigmas.push_back(sigma);
                call_steps.push_back((float)step);
                sd::guidance::GuiderOutput out;
                out.pred = analytic_denoise(xin, sigma);
                if (m.method == EULER_CFG_PP_SAMPLE_METHOD || m.method == EULER_A_CFG_PP_SAMPLE_METHOD) {
                    out.pred_uncond = analytic_denoise_uncond(xin, sigma);
                }
                return out;
            };
            sd::Tensor<float> result = sample_k_diffusion(m.method, cb, x, sigmas, rng, m.eta, false, nullptr);
            char head[160];
            std::snprintf(head, sizeof(head), "sample %s %s %u %llu %u", m.name, run.scheduler_name, run.steps,
                          (unsigned long long)run.seed, run.numel);
            print_values(head, result.values());
            std::snprintf(head, sizeof(head), "calls %s %s %u %llu %u", m.name, run.scheduler_name, run.steps,
                          (unsigned long long)run.seed, run.numel);
            print_values(head, call_sigmas);
            std::snprintf(head, sizeof(head), "steps %s %s %u %llu %u", m.name, run.scheduler_name, run.steps,
                          (unsigned long long)run.seed, run.numel);
            print_values(head, call_steps);
        }
    }

    // ---- One guided denoiser evaluation, composed the way the reference's sample() lambda does it:
    // scalings and timestep from the denoiser, model input x * c_in, CFG by the reference's
    // ClassifierFreeGuidance, then pred * c_out + x * c_skip. The "model" is ours:
    //   cond_i = 0.3 * in_i + 0.001 * t * (i + 1),  uncond_i = 0.2 * in_i - 0.01 * i.
    for (int v = 0; v < 2; v++) {
        std::shared_ptr<CompVisDenoiser> d = v == 0 ? den : std::make_shared<CompVisVDenoiser>();
        if (v == 1) {
            std::copy(den->sigmas, den->sigmas + TIMESTEPS, d->sigmas);
            std::copy(den->log_sigmas, den->log_sigmas + TIMESTEPS, d->log_sigmas);
        }
        for (float cfg : {1.0f, 7.0f}) {
            float sigma             = 3.7f;
            std::shared_ptr<RNG> rng = std::make_shared<PhiloxRNG>(5);
            sd::Tensor<float> x      = sd::Tensor<float>({12}, rng->randn(12)) * 2.0f;
            std::vector<float> sc    = d->get_scalings(sigma);
            float t                  = d->sigma_to_t(sigma);
            sd::Tensor<float> in     = x * sc[2];
            sd::Tensor<float> cond   = in;
            sd::Tensor<float> uncond = in;
            for (int64_t i = 0; i < in.numel(); i++) {
                cond[i]   = 0.3f * in[i] + 0.001f * t * (float)(i + 1);
                uncond[i] = 0.2f * in[i] - 0.01f * (float)i;
            }
            sd::guidance::ClassifierFreeGuidance guidance(cfg, 1.0f);
            sd::guidance::GuidanceInput gin;
            gin.pred_cond   = &cond;
            gin.pred_uncond = cfg != 1.0f ? &uncond : nullptr;
            sd::Tensor<float> guided   = guidance.forward(gin, {}).pred;
            sd::Tensor<float> denoised = guided * sc[1] + x * sc[0];
            char head[128];
            std::snprintf(head, sizeof(head), "guided %s %.9g %.9g %.9g", v == 0 ? "eps" : "v", cfg, sigma, t);
            print_values(head, denoised.values());
        }
    }

    // ---- Flow matching (appended; the sections above are unchanged). FLUX.1's FluxFlowDenoiser
    // with shift 1.0 (schnell) and 1.15 (dev: the default when the file has guidance_in), and
    // SD3's DiscreteFlowDenoiser with shift 3.
    struct NamedFlow {
        const char* name;
        std::shared_ptr<DiscreteFlowDenoiser> d;
    };
    auto flux_schnell = std::make_shared<FluxFlowDenoiser>();
    flux_schnell->set_shift(1.0f);
    auto flux_dev = std::make_shared<FluxFlowDenoiser>();
    flux_dev->set_shift(1.15f);
    auto sd3 = std::make_shared<DiscreteFlowDenoiser>(3.0f);
    NamedFlow flows[] = {{"flux1", flux_schnell}, {"flux1.15", flux_dev}, {"sd3_3", sd3}};
    std::vector<float> flow_probe_ts    = {0.f, 0.5f, 1.f, 10.25f, 499.5f, 998.75f, 999.f};
    std::vector<float> flow_probe_sigma = {0.001f, 0.0285f, 0.3f, 0.5f, 0.75f, 0.999f, 1.0f};
    for (const auto& f : flows) {
        char head[128];
        std::snprintf(head, sizeof(head), "flow %s range", f.name);
        print_values(head, {f.d->sigma_min(), f.d->sigma_max()});
        std::vector<float> out;
        for (float t : flow_probe_ts) {
            out.push_back(f.d->t_to_sigma(t));
        }
        std::snprintf(head, sizeof(head), "flow %s t_to_sigma", f.name);
        print_values(head, out);
        out.clear();
        for (float s : flow_probe_sigma) {
            out.push_back(f.d->sigma_to_t(s));
            auto sc = f.d->get_scalings(s);
            out.push_back(sc[0]);
            out.push_back(sc[1]);
            out.push_back(sc[2]);
        }
        std::snprintf(head, sizeof(head), "flow %s sigma_to_t_scalings", f.name);
        print_values(head, out);
        for (const auto& s : schedulers) {
            if (s.type == AYS_SCHEDULER) {
                continue;  // no noise levels for FLUX/SD3 (the reference returns zeros)
            }
            bool one_step_defined = s.type != KARRAS_SCHEDULER && s.type != EXPONENTIAL_SCHEDULER && s.type != GITS_SCHEDULER;
            for (uint32_t n : {1u, 2u, 4u, 10u, 20u, 28u}) {
                if (n == 1 && !one_step_defined) {
                    continue;
                }
                std::snprintf(head, sizeof(head), "flow %s schedule %s %u", f.name, s.name, n);
                print_values(head, f.d->get_sigmas(n, 0, s.type, VERSION_FLUX));
            }
        }
    }

    // ---- Samplers on a flow schedule (is_flow_denoiser = true), the analytic denoiser as above,
    // the start latent from the flow noise_scaling of zeros.
    NamedMethod flow_methods[] = {
        {"euler", EULER_SAMPLE_METHOD, 0.f},
        {"euler_a", EULER_A_SAMPLE_METHOD, 1.f},
        {"euler_a_eta05", EULER_A_SAMPLE_METHOD, 0.5f},
        {"euler_a_eta2", EULER_A_SAMPLE_METHOD, 2.f},
        {"heun", HEUN_SAMPLE_METHOD, 0.f},
        {"dpm2", DPM2_SAMPLE_METHOD, 0.f},
        {"dpm++2m", DPMPP2M_SAMPLE_METHOD, 0.f},
        {"dpm++2mv2", DPMPP2Mv2_SAMPLE_METHOD, 0.f},
        {"ipndm", IPNDM_SAMPLE_METHOD, 0.f},
        {"ipndm_v", IPNDM_V_SAMPLE_METHOD, 0.f},
        {"lcm", LCM_SAMPLE_METHOD, 0.f},
        {"ddim_trailing", DDIM_TRAILING_SAMPLE_METHOD, 0.f},
        {"ddim_trailing_eta1", DDIM_TRAILING_SAMPLE_METHOD, 1.f},
        {"tcd", TCD_SAMPLE_METHOD, 0.f},
        {"euler_cfg_pp", EULER_CFG_PP_SAMPLE_METHOD, 0.f},
        {"euler_a_cfg_pp", EULER_A_CFG_PP_SAMPLE_METHOD, 1.f},
        {"dpm++2s_a", DPMPP2S_A_SAMPLE_METHOD, 1.f},
        {"dpm++2s_a_eta0", DPMPP2S_A_SAMPLE_METHOD, 0.f},
        {"res_multistep", RES_MULTISTEP_SAMPLE_METHOD, 1.f},
        {"res_multistep_eta0", RES_MULTISTEP_SAMPLE_METHOD, 0.f},
        {"res_2s", RES_2S_SAMPLE_METHOD, 1.f},
        {"er_sde", ER_SDE_SAMPLE_METHOD, 1.f},
        {"er_sde_eta0", ER_SDE_SAMPLE_METHOD, 0.f},
        {"euler_ge", EULER_GE_SAMPLE_METHOD, 1.f},
        {"euler_ge_eta0", EULER_GE_SAMPLE_METHOD, 0.f},
    };
    struct FlowRun {
        std::shared_ptr<DiscreteFlowDenoiser> d;
        const char* flow_name;
        scheduler_t scheduler;
        const char* scheduler_name;
        uint32_t steps;
        uint64_t seed;
        uint32_t numel;
    };
    FlowRun flow_runs[] = {
        {flux_schnell, "flux1", DISCRETE_SCHEDULER, "discrete", 4, 42, 16},
        {flux_dev, "flux1.15", SIMPLE_SCHEDULER, "simple", 6, 7, 13},
        {sd3, "sd3_3", DISCRETE_SCHEDULER, "discrete", 5, 3, 16},
    };
    for (const auto& m : flow_methods) {
        for (const auto& run : flow_runs) {
            std::vector<float> sigmas = run.d->get_sigmas(run.steps, 0, run.scheduler, VERSION_FLUX);
            std::shared_ptr<RNG> rng  = std::make_shared<PhiloxRNG>(run.seed);
            sd::Tensor<float> init    = sd::zeros<float>({(int64_t)run.numel});
            sd::Tensor<float> noise   = sd::Tensor<float>::randn_like(init, rng);
            sd::Tensor<float> x       = run.d->noise_scaling(sigmas[0], noise, init);
            std::vector<float> call_sigmas;
            denoise_cb_t cb = [&](const sd::Tensor<float>& xin, float sigma, int) {
                call_sigmas.push_back(sigma);
                sd::guidance::GuiderOutput out;
                out.pred = analytic_denoise(xin, sigma);
                if (m.method == EULER_CFG_PP_SAMPLE_METHOD || m.method == EULER_A_CFG_PP_SAMPLE_METHOD) {
                    out.pred_uncond = analytic_denoise_uncond(xin, sigma);
                }
                return out;
            };
            sd::Tensor<float> result = sample_k_diffusion(m.method, cb, x, sigmas, rng, m.eta, true, nullptr);
            char head[160];
            std::snprintf(head, sizeof(head), "flowsample %s %s %s %u %llu %u", m.name, run.flow_name,
                          run.scheduler_name, run.steps, (unsigned long long)run.seed, run.numel);
            print_values(head, result.values());
            std::snprintf(head, sizeof(head), "flowcalls %s %s %s %u %llu %u", m.name, run.flow_name,
                          run.scheduler_name, run.steps, (unsigned long long)run.seed, run.numel);
            print_values(head, call_sigmas);
        }
    }

    // ---- One flow-guided denoiser evaluation (FLUX.1 dev schedule, sigma 0.7): flow scalings,
    // timestep sigma_to_t(sigma), CFG, pred * c_out + x * c_skip. Same "model" as above.
    for (float cfg : {1.0f, 3.5f}) {
        float sigma              = 0.7f;
        std::shared_ptr<RNG> rng = std::make_shared<PhiloxRNG>(5);
        sd::Tensor<float> x      = sd::Tensor<float>({12}, rng->randn(12)) * 2.0f;
        std::vector<float> sc    = flux_dev->get_scalings(sigma);
        float t                  = flux_dev->sigma_to_t(sigma);
        sd::Tensor<float> in     = x * sc[2];
        sd::Tensor<float> cond   = in;
        sd::Tensor<float> uncond = in;
        for (int64_t i = 0; i < in.numel(); i++) {
            cond[i]   = 0.3f * in[i] + 0.001f * t * (float)(i + 1);
            uncond[i] = 0.2f * in[i] - 0.01f * (float)i;
        }
        sd::guidance::ClassifierFreeGuidance guidance(cfg, 1.0f);
        sd::guidance::GuidanceInput gin;
        gin.pred_cond   = &cond;
        gin.pred_uncond = cfg != 1.0f ? &uncond : nullptr;
        sd::Tensor<float> guided   = guidance.forward(gin, {}).pred;
        sd::Tensor<float> denoised = guided * sc[1] + x * sc[0];
        char head[128];
        std::snprintf(head, sizeof(head), "flowguided flux1.15 %.9g %.9g %.9g", cfg, sigma, t);
        print_values(head, denoised.values());
    }
    return 0;
}
