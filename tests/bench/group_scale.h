// `group_bench scale`: the group simulated at thousands of nodes (group_scale.cc).
#pragma once

namespace ckpt::bench {

// argv[0] is "scale".
int ScaleMain(int argc, char** argv);

}  // namespace ckpt::bench
