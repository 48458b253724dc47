// Selective restore: which tensors a selection picks, and how the restorer matches the
// selected registered tensors with the checkpoint's.
#include <catch2/catch.hpp>

#include "common/status.h"
#include "format/tensor_selection.h"
#include "daemon/restorer.h"

using namespace ckpt;
using namespace ckpt::daemon;
using namespace ckpt::format;

namespace {

TensorSelection Select(std::vector<std::string> include, std::vector<std::string> exclude) {
  auto s = TensorSelection::Make(std::move(include), std::move(exclude));
  REQUIRE(s.ok());
  return *s;
}

std::vector<RegisteredTensor> Registered(std::vector<std::string> names) {
  std::vector<RegisteredTensor> out;
  for (auto& n : names) out.push_back({.name = std::move(n), .dtype = "F32", .shape = {1}, .nbytes = 4});
  return out;
}

std::vector<std::string> Names(const std::vector<const RegisteredTensor*>& tensors) {
  std::vector<std::string> out;
  for (const RegisteredTensor* t : tensors) out.push_back(t->name);
  return out;
}

const std::vector<std::string> kStored = {"layers.0.w", "layers.1.w", "optim.layers.0.w.exp_avg",
                                          "optim.layers.1.w.exp_avg"};

}  // namespace

TEST_CASE("selection: include and exclude globs; * spans dots") {
  CHECK(TensorSelection().everything());
  CHECK(TensorSelection().Selects("anything"));
  auto weights = Select({}, {"optim.*"});
  CHECK(weights.Selects("layers.0.w"));
  CHECK_FALSE(weights.Selects("optim.layers.0.w.exp_avg"));
  auto layer = Select({"layers.1.*", "optim.layers.1.*"}, {"*.exp_avg"});
  CHECK(layer.Selects("layers.1.w"));
  CHECK_FALSE(layer.Selects("layers.0.w"));
  CHECK_FALSE(layer.Selects("optim.layers.1.w.exp_avg"));  // excluded wins
  CHECK(Select({"layers.[01].w"}, {}).Selects("layers.1.w"));
  CHECK(weights.Describe() == "exclude [optim.*]");
}

TEST_CASE("selection: bad patterns are refused, naming the problem") {
  CHECK_THAT(Message(TensorSelection::Make({""}, {}).status()), Catch::Contains("empty include"));
  CHECK_THAT(Message(TensorSelection::Make({}, {std::string(2000, 'x')}).status()),
             Catch::Contains("longer than 1024"));
  CHECK_THAT(Message(TensorSelection::Make({}, {std::string("a\0b", 3)}).status()),
             Catch::Contains("NUL"));
  std::vector<std::string> many(TensorSelection::kMaxPatterns + 1, "x");
  CHECK(absl::IsInvalidArgument(TensorSelection::Make(many, {}).status()));
}

TEST_CASE("match: the weights of a full checkpoint into a model without optimizer state") {
  auto registered = Registered({"layers.0.w", "layers.1.w"});
  RestoreResult result;
  RestoreSpec spec{.selection = Select({}, {"optim.*"})};
  auto matched = MatchTensors(registered, kStored, spec, 7, result);
  REQUIRE(matched.ok());
  CHECK(Names(*matched) == std::vector<std::string>{"layers.0.w", "layers.1.w"});
  CHECK(result.tensors == 2);
  CHECK(result.skipped == 2);

  // Without the selection the optimizer state is "in the checkpoint but not registered".
  RestoreResult strict;
  auto refused = MatchTensors(registered, kStored, RestoreSpec{}, 7, strict);
  CHECK(absl::IsFailedPrecondition(refused.status()));
  CHECK_THAT(Message(refused.status()), Catch::Contains("2 in the checkpoint but not registered") &&
                                            Catch::Contains("optim.layers.0.w.exp_avg"));
}

TEST_CASE("match: registered tensors left out keep their values; missing ones are named") {
  auto registered = Registered({"layers.0.w", "layers.1.w", "head.w"});
  RestoreResult result;
  RestoreSpec only_layers{.selection = Select({"layers.*"}, {})};
  auto matched = MatchTensors(registered, kStored, only_layers, 7, result);
  REQUIRE(matched.ok());
  CHECK(Names(*matched) == std::vector<std::string>{"layers.0.w", "layers.1.w"});

  RestoreSpec everything_but_optim{.selection = Select({}, {"optim.*"})};
  auto missing = MatchTensors(registered, kStored, everything_but_optim, 7, result);
  CHECK(absl::IsFailedPrecondition(missing.status()));
  CHECK_THAT(Message(missing.status()),
             Catch::Contains("1 registered but not in the checkpoint (head.w)") &&
                 Catch::Contains("exclude [optim.*]"));

  everything_but_optim.allow_missing = true;
  RestoreResult partial;
  auto lenient = MatchTensors(registered, kStored, everything_but_optim, 7, partial);
  REQUIRE(lenient.ok());
  CHECK(Names(*lenient) == std::vector<std::string>{"layers.0.w", "layers.1.w"});
  CHECK(partial.not_in_checkpoint == std::vector<std::string>{"head.w"});
  CHECK(partial.not_registered.empty());
}

TEST_CASE("match: a selection that picks nothing is an error, not an empty restore") {
  RestoreResult result;
  RestoreSpec typo{.selection = Select({"layer.*"}, {}), .allow_missing = true};
  auto none = MatchTensors(Registered({"layers.0.w"}), kStored, typo, 7, result);
  CHECK(absl::IsInvalidArgument(none.status()));
  CHECK_THAT(Message(none.status()), Catch::Contains("include [layer.*] selects none of the 4"));
}

TEST_CASE("match: excluding \"*\" restores the train state alone, whatever is registered") {
  RestoreResult result;
  RestoreSpec state_only{.selection = Select({}, {"*"})};
  auto none = MatchTensors(Registered({"layers.0.w", "not.saved"}), kStored, state_only, 7, result);
  REQUIRE(none.ok());
  CHECK(none->empty());
  CHECK(result.tensors == 0);
  CHECK(result.skipped == 4);
  CHECK(result.not_in_checkpoint.empty());
  // A pattern that merely matches everything is still a selection, not this.
  RestoreSpec star_star{.selection = Select({}, {"**"})};
  CHECK(absl::IsInvalidArgument(MatchTensors(Registered({"layers.0.w"}), kStored, star_star, 7, result).status()));
}

TEST_CASE("match: allow_missing with no name in common is an error, not a silent fresh start") {
  RestoreResult result;
  RestoreSpec lenient{.allow_missing = true};
  auto prefixed = MatchTensors(Registered({"module.layers.0.w", "module.layers.1.w"}), kStored,
                               lenient, 7, result);
  CHECK(absl::IsFailedPrecondition(prefixed.status()));
  CHECK_THAT(Message(prefixed.status()), Catch::Contains("none of the 4 tensors") &&
                                             Catch::Contains("layers.0.w"));
}

TEST_CASE("selection: the patterns together are bounded") {
  std::vector<std::string> many(100, std::string(1000, '*'));
  auto big = TensorSelection::Make(many, {});
  CHECK(absl::IsInvalidArgument(big.status()));
  CHECK_THAT(Message(big.status()), Catch::Contains("add up to 100000 bytes"));
}
