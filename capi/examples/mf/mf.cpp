// Matrix factorization through Ferry's C ABI: every process of the cluster trains on its share
// of the users of a planted low-rank rating matrix (the same one on every process), pulling the
// rows a rating touches, taking an SGD step and pushing the changes; rank 0 reports test RMSE per
// epoch and checks that it fell. Start it like any Ferry program:
//   ferry launch -n 2 -- ./ferry-mf-example
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ferry.h"

namespace {

constexpr uint64_t kUsers = 200, kItems = 100, kTrain = 8000, kTest = 800;
constexpr int kRank = 4, kLen = kRank + 1, kEpochs = 10;  // a row: bias, then the factors
constexpr float kRate = 0.05f, kReg = 0.02f;

// Stops the program with Ferry's message when a call fails.
void check(int code, const char* what) {
  if (code != FERRY_OK) {
    std::fprintf(stderr, "%s failed (%d): %s\n", what, code, ferry_last_error());
    std::exit(1);
  }
}

// A small deterministic generator, identical on every process.
struct Lcg {
  uint64_t state;
  double next() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>(state >> 11) / 9007199254740992.0;
  }
};

struct Rating {
  uint64_t user, item;
  float value;
};

std::vector<Rating> planted(uint64_t count, uint64_t seed) {
  Lcg truth{7};
  std::vector<float> u(kUsers * kRank), v(kItems * kRank);
  for (auto& x : u) x = static_cast<float>(truth.next() * 2 - 1);
  for (auto& x : v) x = static_cast<float>(truth.next() * 2 - 1);
  Lcg pick{seed};
  std::vector<Rating> out;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t a = static_cast<uint64_t>(pick.next() * kUsers), b = static_cast<uint64_t>(pick.next() * kItems);
    float dot = 0;
    for (int k = 0; k < kRank; ++k) dot += u[a * kRank + k] * v[b * kRank + k];
    out.push_back({a, b, dot});
  }
  return out;
}

float predict(const float* p, const float* q) {
  float r = p[0] + q[0];
  for (int k = 1; k < kLen; ++k) r += p[k] * q[k];
  return r;
}

}  // namespace

int main() {
  FerryConfig* config = ferry_config_new();
  check(ferry_config_add_table(config, "users", kUsers, kLen), "adding users");
  check(ferry_config_add_table(config, "items", kItems, kLen), "adding items");
  FerryNode* node = nullptr;
  check(ferry_node_start(config, &node), "starting the node");
  ferry_config_free(config);
  uint32_t rank = 0, nodes = 0, users = 0, items = 0;
  check(ferry_node_info(node, &rank, &nodes), "node info");
  check(ferry_table(node, "users", &users), "table users");
  check(ferry_table(node, "items", &items), "table items");
  FerryWorker* w = nullptr;
  check(ferry_worker_new(node, &w), "a worker");

  // Errors are codes with a message, never crashes: a buffer of the wrong length.
  uint64_t key = 0;
  float small[1];
  if (ferry_pull(w, users, &key, 1, small, 1) != FERRY_ERR_ARGUMENT || std::string(ferry_last_error()).empty()) {
    std::fprintf(stderr, "a wrong-length pull was not refused with a message\n");
    return 1;
  }

  if (rank == 0) {  // initial values, set once for the whole cluster
    Lcg init{11};
    for (uint32_t table : {users, items}) {
      uint64_t n = table == users ? kUsers : kItems;
      std::vector<uint64_t> keys(n);
      std::vector<float> values(n * kLen);
      for (uint64_t i = 0; i < n; ++i) keys[i] = i;
      for (auto& x : values) x = static_cast<float>(init.next() - 0.5);
      uint64_t ticket = 0;
      check(ferry_push_async(w, table, keys.data(), n, values.data(), values.size(), true, &ticket), "setting");
      check(ferry_wait(w, ticket), "waiting for the set");
    }
  }
  check(ferry_barrier(w), "barrier");

  const std::vector<Rating> train = planted(kTrain, 1), test = planted(kTest, 2);
  std::vector<uint64_t> mine;  // this process's users, moved here once
  for (uint64_t u = rank; u < kUsers; u += nodes) mine.push_back(u);
  check(ferry_localize(w, users, mine.data(), mine.size()), "localizing my users");

  double first = 0, last = 0;
  for (int epoch = 1; epoch <= kEpochs; ++epoch) {
    float p[kLen], q[kLen], dp[kLen], dq[kLen];
    for (const Rating& r : train) {
      if (r.user % nodes != rank) continue;
      uint64_t ticket = 0;
      check(ferry_pull_async(w, items, &r.item, 1, &ticket), "pulling an item");
      check(ferry_pull(w, users, &r.user, 1, p, kLen), "pulling a user");
      check(ferry_wait_pull(w, ticket, q, kLen), "waiting for the item");
      float err = r.value - predict(p, q);
      dp[0] = kRate * (err - kReg * p[0]);
      dq[0] = kRate * (err - kReg * q[0]);
      for (int k = 1; k < kLen; ++k) {
        dp[k] = kRate * (err * q[k] - kReg * p[k]);
        dq[k] = kRate * (err * p[k] - kReg * q[k]);
      }
      check(ferry_push(w, users, &r.user, 1, dp, kLen), "pushing a user");
      check(ferry_push(w, items, &r.item, 1, dq, kLen), "pushing an item");
    }
    check(ferry_barrier(w), "barrier");
    if (rank == 0) {
      std::vector<uint64_t> uk(kUsers), ik(kItems);
      for (uint64_t i = 0; i < kUsers; ++i) uk[i] = i;
      for (uint64_t i = 0; i < kItems; ++i) ik[i] = i;
      std::vector<float> uv(kUsers * kLen), iv(kItems * kLen);
      check(ferry_pull(w, users, uk.data(), kUsers, uv.data(), uv.size()), "pulling all users");
      check(ferry_pull(w, items, ik.data(), kItems, iv.data(), iv.size()), "pulling all items");
      double sse = 0;
      for (const Rating& r : test) {
        double e = r.value - predict(&uv[r.user * kLen], &iv[r.item * kLen]);
        sse += e * e;
      }
      last = std::sqrt(sse / kTest);
      if (epoch == 1) first = last;
      std::printf("capi-mf epoch %d rmse %.4f\n", epoch, last);
    }
    check(ferry_barrier(w), "barrier");
  }
  FerryStats stats{};
  check(ferry_node_stats(node, &stats), "statistics");
  std::printf("capi-mf rank %u: %llu local and %llu remote key accesses\n", rank, static_cast<unsigned long long>(stats.local_accesses),
              static_cast<unsigned long long>(stats.remote_accesses));
  // Traffic by message kind, and how long the localized users took to arrive.
  std::vector<uint64_t> messages(ferry_message_kinds()), bytes(ferry_message_kinds());
  check(ferry_node_traffic(node, messages.data(), bytes.data(), messages.size()), "traffic by kind");
  std::string traffic;
  for (size_t k = 0; k < messages.size(); k++) {
    if (messages[k] > 0) {
      traffic += " " + std::string(ferry_message_kind_name(k)) + "=" + std::to_string(messages[k]) + "/" + std::to_string(bytes[k]) + "B";
    }
  }
  FerryLatency relocation{};
  check(ferry_node_latency(node, "relocation", &relocation), "relocation latency");
  std::printf("capi-mf rank %u: messages sent by kind:%s; %llu keys relocated here, median %.1f us\n", rank, traffic.c_str(),
              static_cast<unsigned long long>(relocation.count), relocation.p50_ns / 1e3);
  ferry_worker_free(w);
  check(ferry_node_finalize(node), "finalizing");
  if (rank == 0) {
    if (!(last < 0.8 * first)) {
      std::fprintf(stderr, "RMSE did not fall: %.4f -> %.4f\n", first, last);
      return 1;
    }
    std::printf("capi-mf ok: RMSE %.4f -> %.4f\n", first, last);
  }
  return 0;
}
