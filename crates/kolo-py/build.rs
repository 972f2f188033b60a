fn main() {
    // the heap copy of TensorFlow's done callback (src/tensorflow/done.cc)
    println!("cargo:rerun-if-changed=src/tensorflow/done.cc");
    cc::Build::new().cpp(true).std("c++17").file("src/tensorflow/done.cc").compile("kolo_tf_done");
}
