# prefix_bench: trace replay (sharing vs not, hit rate vs an unbounded cache) and Match latency.
if(KVBANK_BUILD_SERVICE)
  add_executable(prefix_bench ${CMAKE_CURRENT_LIST_DIR}/prefix_bench.cc)
  target_link_libraries(prefix_bench PRIVATE kvbank_rpc kvbank_client)
  kvbank_compile_options(prefix_bench)
  add_test(NAME bench_smoke_prefix COMMAND prefix_bench --quick)
  set_tests_properties(bench_smoke_prefix PROPERTIES LABELS bench TIMEOUT 120)
endif()
