// `kvbank plan`: the offline capacity planner (no server needed). See plan.cc for the flags.
#ifndef KVBANK_CLIENT_CLI_PLAN_H_
#define KVBANK_CLIENT_CLI_PLAN_H_

namespace kvbank {

// Runs `kvbank plan ...`. argv[0] is "plan"; the rest are its flags. Returns the exit status: 0 on
// success (a sweep whose PNG could not be drawn included), 2 on bad usage, 1 when a file cannot be
// written.
int PlanMain(int argc, char** argv);

}  // namespace kvbank

#endif  // KVBANK_CLIENT_CLI_PLAN_H_
