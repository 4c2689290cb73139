# cmake -DUCP=<ucp> -DOUT=<dir> -DFIXTURES=<fixtures> -P make_seeds.cmake
# Universal files of two real DeepSpeed fixtures: seeds for fuzz_universal.
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
foreach(name ds0145_z1_bf16_w2_mlp ds0145_z3_fp32_w1_mlp)
  execute_process(COMMAND "${UCP}" to-universal "${FIXTURES}/deepspeed-0.14.5/${name}"
                  -o "${OUT}/${name}.ucp.h5" -q RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "ucp to-universal ${name} failed (${rc})")
  endif()
endforeach()
